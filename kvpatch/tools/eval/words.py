"""Word lists the haystacks and needle keys are drawn from."""

WORDS = """
able about above across act add afraid after again against age ago agree air all allow almost
alone along already also always among amount and angle animal answer any appear apple area arm
army around arrive art ask at atom baby back bad ball band bank bar base basic bear beat beauty
bed been before began begin behind bell best better between big bird bit black block blood blow
blue board boat body bone book born both bottom bought box boy branch bread break bright bring
broad brother brown build burn busy buy call came camp can capital captain car card care carry
case cat catch cause cell center century chair chance change character charge chart check chief
child choose church circle city claim class clean clear climb clock close cloth cloud coast coat
cold collect colony color column come common company compare complete condition connect consider
contain continent control cook cool copy corn corner cost cotton could count country course cover
cow crease create crop cross crowd cry current cut dad dance danger dark day dead deal dear death
decide deep degree depend describe desert design determine develop dictionary differ difficult
dinner direct discuss distant divide doctor does dog dollar done door double down draw dream dress
drink drive drop dry duck during each ear early earth ease east eat edge effect egg eight either
electric element else end enemy energy engine enough enter equal equate even evening event ever
every exact example except excite exercise expect experience experiment eye face fact fair fall
family famous far farm fast father favor fear feed feel feet fell felt few field fig fight figure
fill final find fine finger finish fire first fish fit five flat floor flow flower fly follow food
foot force forest form forward found fraction free fresh friend front fruit full fun game garden
gas gather gave general gentle get girl give glad glass gold gone good got govern grand grass gray
great green grew ground group grow guess guide gun hair half hand happen happy hard hat have head
hear heard heart heat heavy held help here high hill history hold hole home hope horse hot hour
house huge human hunt hurry ice idea inch include industry insect instant instrument interest
iron island job join joy jump keep kept kill kind king knew know lady lake land language large
last late laugh lay lead learn least leave led left leg length less letter level lie life lift
light like line liquid list listen little live locate log lone long look lost loud love low
machine made magnet main major make man many map mark market mass master match material matter
meant measure meat meet melody metal method middle might mile milk mind mine minute miss mix
modern molecule moment money month moon morning mother motion mount mountain mouth move music
name nation natural nature near necessary neck need neighbor new next night noise noon north nose
note nothing notice noun now number numeral object observe occur ocean offer office often oil old
once open operate opposite order organ original other out oxygen page paint pair paper paragraph
parent part particular party pass past path pattern pay people perhaps period person phrase pick
picture piece pitch place plain plan plane planet plant play please plural poem point poor
populate port pose position possible post pound power practice prepare present press pretty print
probable problem process produce product proper property protect prove provide pull push quart
question quick quiet quite quotient race radio rail rain raise ran range rather reach read ready
real reason receive record region remember repeat reply represent require rest result rich ride
right ring rise river road rock roll room root rope rose round row rub rule run safe said sail
salt same sand save saw say scale school science score sea search season seat second section see
seed seem segment select self sell send sense sentence separate serve settle seven several shape
share sharp sheet shell shine ship shoe shop shore short shoulder shout show side sight sign
silent silver similar simple since sing single sister sit six size skill skin sky sleep slip slow
small smell smile snow soft soil soldier solution solve some son song soon sound south space speak
special speech speed spell spend spoke spot spread spring square stand star start state station
stay stead steam steel step stick still stone stood stop store story straight strange stream
street stretch string strong student study subject substance subtract success such sudden suffix
sugar suggest suit summer sun supply support sure surface surprise swim syllable symbol system
table tail take talk tall teach team teeth tell temperature term test than thank thick thin thing
third those though thought thousand three through throw tie time tiny tire together told tone too
took tool total touch toward town track trade train travel tree triangle trip trouble truck try
tube turn twenty type under unit until usual valley value vary verb very view village visit voice
vowel wait walk wall want warm wash watch water wave wear weather week weight west wheel where
whether while white whole wide wife wild will win wind window wing winter wire wish woman wonder
wood word work world write wrong yard year yellow young
""".split()  # noqa: SIM905

ADJECTIVES = """
abundant ancient bitter brave calm clever crooked curious eager elegant faint fierce fragile
gentle giant glossy hollow humble icy jolly keen lively loyal misty noble odd polite quiet rapid
rusty shiny silent sleepy smooth sour steady sticky swift tame tender tidy vivid wary wicked witty
""".split()  # noqa: SIM905

NOUNS = """
anchor badger basket beacon blanket bucket cactus candle castle cobra comet compass crystal
dolphin dragon engine falcon feather fiddle garden glacier hammer harbor helmet jacket kettle
lantern lemon magnet meadow mirror needle orchard otter parrot pebble pillow pirate quilt rabbit
ribbon saddle tablet teapot thimble tiger tulip tunnel violin walrus wagon whistle window zebra
""".split()  # noqa: SIM905
